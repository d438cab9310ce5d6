"""A long-lived bootstrap peer with a persistent identity (issue 3)."""
