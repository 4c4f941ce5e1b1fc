"""The gateway: public API, the draft -> verify loop, streaming."""
