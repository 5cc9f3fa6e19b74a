-- 0009 belongs to the `http` branch (issue 17). This placeholder only keeps the migrations
-- numbered without gaps on the `versions` branch; on merge, take the http branch's file.
SELECT 1;
