/dev/fd/3: line 34: ./ev.sh: No such file or directory
