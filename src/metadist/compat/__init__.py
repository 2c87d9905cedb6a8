"""Drop-in surfaces for programs written for other libraries: change only the imports."""
