"""The network lab: namespaces, veth links, shaping, loss relays and the Mininet testbed."""
