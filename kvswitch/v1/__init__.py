"""Generated gRPC/protobuf code for the kvswitch.v1 API (see proto/ and docs/PROTOCOL.md)."""
