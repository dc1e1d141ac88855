"""Capacity planning from configs alone: FLOPs, weight bytes and activation peaks of a model's
components counted on the meta device, and the device peaks they are compared with."""
