"""Turning the swarm's chat-shaped answers into each API's own: chat completions (and their tool
calls), text completions, the Responses API. Pure: shared_schema and the standard library only.
"""
