"""Moving data between processes: the hidden-state handoff, step sockets, the wire format and gRPC server plumbing."""
