"""Server lifecycle: profiles, start/stop, the CPU reference model, /metrics scraping, watch and dashboard."""
