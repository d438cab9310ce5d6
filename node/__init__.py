"""The volunteer process: model, data, MIT instances, adaptive batch, trainer loop, simulator."""
