"""The node's local control plane: control.proto and its generated gRPC code."""
