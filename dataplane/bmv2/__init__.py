"""BMv2: the P4Runtime control plane of p4src/v1model and the simple_switch_grpc launcher."""
