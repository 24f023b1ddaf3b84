"""The features contract: what one captured sample holds, the sharded safetensors writer with its manifest, the reader."""
