"""homagg launcher: Mininet topologies, the demo, and the targets (bmv2 or software)."""
