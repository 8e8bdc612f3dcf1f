"""gRPC listeners of the router (server.py) and the code generated from proto/ (gen/)."""
