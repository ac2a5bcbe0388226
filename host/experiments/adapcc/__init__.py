"""AdapCC studies: synthesis and coordinator figures, partial and fault-tolerant training, the gloo check."""
