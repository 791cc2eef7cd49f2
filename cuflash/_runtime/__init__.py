"""Runtime: the device, params packed by field name, NVRTC builds, tensor maps and kernel launches."""
