"""Measurements that run models or processes on this machine: layer profiles (the real modules of
:mod:`omnibal.train.layers`), the CPU's math and copy rates, gloo links between local processes.

This layer sits above ``train`` (it runs the trainer's modules) so that ``cost`` stays a pure model: the cost
layer reads the profiles and hardware specs measured here, it never measures itself.
"""
