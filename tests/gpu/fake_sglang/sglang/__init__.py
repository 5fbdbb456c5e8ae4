"""A stand-in `sglang` package for running gpu/firstcross_device.py's main() on the CPU."""
