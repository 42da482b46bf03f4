"""Client side: data, partitions, a node's examples, models, local objectives,
the training loop, DP-SGD and the client's state between rounds."""
