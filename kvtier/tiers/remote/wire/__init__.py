"""The shared tier's wire: RESP, connections (TLS, AUTH), Cluster nodes and slots, and the
redaction and naming of server errors."""
