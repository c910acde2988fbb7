"""Operations: the admin API, its fleet-wide changes, and the operator's console."""
