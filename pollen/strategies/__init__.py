"""Server side: the strategy (sampling, routing, reply checks), the
aggregation step, the server updates, personal evaluation, and the sharing
policies both apps apply. Importing one module here imports nothing else:
a ClientApp reads `sharing` without loading the server's code."""
