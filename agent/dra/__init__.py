"""The DRA front end: Tessera as a Kubernetes DRA driver, a sibling of ``agent.plugin`` fed by the same core.

The kubelet finds the driver through its plugin watcher (``registration``), calls NodePrepareResources and
NodeUnprepareResources on the driver's DRA socket, and reads ResourceSlices the driver publishes through the
API server. The pure decisions live in ``agent.core.dra``; this package only adapts sockets and the API.
"""
