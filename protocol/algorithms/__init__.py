"""The math every peer runs alike, torch and numpy only: codecs, reductions, batch tests, schedule, HeLoCo."""
