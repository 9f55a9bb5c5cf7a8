"""The model: configuration, weights, tokenizer, import of the default model, and the forward
pass over an ops table."""
