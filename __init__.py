"""adloco-node: a decentralized volunteer training node (DiLoCo, AdLoCo, DiLoCoX, HeLoCo)."""
