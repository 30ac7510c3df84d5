"""Apiary's queen: the OpenAI-compatible front of a swarm of volunteer GPU workers."""

__version__ = "0.1.0"
