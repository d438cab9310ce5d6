"""What operators use: checkpoints, the control service and ctl, Prometheus metrics, reachability."""
