"""The host side: everything in the training process after tap values leave the devices."""
