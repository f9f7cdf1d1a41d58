"""chapters"""
