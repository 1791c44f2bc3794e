"""Generated protobuf and gRPC code for clawrl.v1 (see proto/)."""
