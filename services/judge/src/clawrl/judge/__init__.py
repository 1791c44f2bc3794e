"""clawrl.judge: turns finished turns into scored training samples."""
