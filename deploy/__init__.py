"""Deployment material: reference configuration and the emulated rack (``deploy.testnet``)."""
