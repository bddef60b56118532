"""The cache servers' client library: one server (server_client), a whole ring
(ring_client), and the same-host read path (localread, readpath)."""
