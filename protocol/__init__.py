"""What peers agree on: the math (algorithms/), how they talk (transport/), the control plane (control/)."""
