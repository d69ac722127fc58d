"""verify: prove the adjoints of linop operators numerically, exactly and symbolically."""
