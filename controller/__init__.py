"""homagg controller: builds the P4 program, installs it and the jobs over P4Runtime."""
