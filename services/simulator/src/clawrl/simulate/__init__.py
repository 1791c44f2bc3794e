"""clawrl.simulate: a scripted user for the gateway (`clawrl simulate`)."""
