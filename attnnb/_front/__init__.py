"""Validation and dispatch: the arguments of every public function checked and made
canonical, the backend chosen, the call made."""
