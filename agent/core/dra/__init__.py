"""DRA, the pure part: the device model, ResourceSlices, taints, claims, opaque configs, CDI specs and the
prepared-claims checkpoint."""
