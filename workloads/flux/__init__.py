"""FLUX.1: the rectified-flow diffusion transformer of MLPerf Training's flux1 benchmark."""
