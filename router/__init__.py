"""The gRPC router: hashes each prompt, asks the block-hash index who holds it, routes there."""
