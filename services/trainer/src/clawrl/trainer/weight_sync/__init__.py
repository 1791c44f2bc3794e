"""clawrl.trainer.weight_sync: the weight-sync job (pause every gateway under a lease, load the
new policy into every engine, resume with the new version) and its launcher."""
