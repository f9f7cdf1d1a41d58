"""scratch"""
