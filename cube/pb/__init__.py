"""Generated protobuf and gRPC stubs (from proto/*.proto by cube.pb.generate; do not edit)."""
