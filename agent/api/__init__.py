"""Generated gRPC stubs of the kubelet APIs (proto/). Regenerate with: python proto/generate.py"""
