"""MIG layouts: mig-parted's config file (``layout_file``), and the manager that brings GPUs to a layout.

The pure planning (which profiles fit, where each instance goes, what to destroy and create) lives in
``agent.core.mig_layout``; this package reads and writes mig-parted's file format and runs the plan.
"""
