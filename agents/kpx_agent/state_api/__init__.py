"""The node-local state API: the agent serves its node-local state over gRPC (kpx.localstate.v1).

convert.py maps the node-local model (model.types) to the protobuf messages, publisher.py keeps the
revisions and answers watches, server.py is the gRPC edge (unix socket or loopback TCP).
"""
