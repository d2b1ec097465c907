"""Data plane: wire format, reduce kernels and aggregation of the reduction appliance."""
