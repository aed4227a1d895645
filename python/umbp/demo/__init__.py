"""The UMBP demo: vLLM CPU serving a locally built model with UMBPStoreConnector."""
