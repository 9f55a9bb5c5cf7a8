"""The engine: scheduling, requests, sampling, pins and the second tier around a model runner."""
