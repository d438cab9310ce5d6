"""The solo trainer: one peer averaging in a group of one (adloco-node --offline)."""
