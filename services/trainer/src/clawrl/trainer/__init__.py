"""clawrl.trainer: PPO-style steps on scored samples, checkpoints and the weight-sync job."""
