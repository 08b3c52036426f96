# CUDA C sources of cupy-fused, compiled at run time by NVRTC (cupy_fused._runtime).
