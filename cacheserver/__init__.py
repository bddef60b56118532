"""Peer cache daemon: content-addressed values on local NVMe, served over gRPC
and a binary data plane; servers form a consistent-hash ring."""
