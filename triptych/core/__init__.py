"""What every layer uses: errors, model identity, devices, progress, media codecs, owner-only files, the CPU offload pool."""
